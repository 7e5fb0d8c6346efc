"""What every scenario gets: parameters, the caches, the progress bar, the bookkeeping."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from django.core.cache.backends.base import BaseCache

from kvcache_bench.caches import CacheSpec
from kvcache_bench.data import DEFAULT_MIX, Values
from kvcache_bench.storage import WrittenKeys


MIN_CAPACITY_MB = 16


@dataclass(frozen=True)
class Parameters:
    rounds: int = 10  # timed rounds per operation, interleaved across caches
    calls: int = 50  # calls per cache and operation in each round
    warmup_rounds: int = 1
    batch: int = 20  # keys per *_many call
    values: str = DEFAULT_MIX  # the value mix (kvcache_bench.data.MIXES) of ops, storage, capacity
    value_count: int = 256  # distinct values of the mix that ops cycles through
    large_size: int = 32 * 1024
    seed: int = 1234
    rows: tuple[int, ...] = (1_000, 10_000, 100_000)
    row_calls: int = 200  # set and get calls per cache at each table size
    scale_rows: tuple[int, ...] = (100_000, 1_000_000)  # scale: table sizes (10_000_000 on request)
    scale_calls: int = 1000  # scale: calls per cache, operation and access pattern at each size
    scale_buffer_pool: float = 0.2  # scale: the InnoDB buffer pool, a fraction of the tables' bytes
    nodes: tuple[int, ...] = (1, 2, 4, 8)
    node_keys: int = 100
    node_calls: int = 300
    workers: tuple[int, ...] = (1, 2, 4, 8)
    iterations: int = 150  # mixed-workload iterations per concurrent worker
    callers: tuple[int, ...] = (8, 32, 128)  # callers at once on one key in stampede
    storage_entries: int = 1000  # entries of the mix written to measure bytes stored
    codec_values: int = 1500  # values of the mix each codec setting encodes and decodes
    capacity_mb: int = 32  # memory (-m) of the memcached node the capacity scenario fills
    capacity_fill: float = 4.0  # bytes of values written into it, as a multiple of its memory
    server_cpu: float | None = None  # shards: each server's CPU quota (cores); None: uncapped
    client_processes: int = 4  # shards throughput: client processes...
    client_threads: int = 8  # ... of this many threads each
    shard_seconds: float = 4.0  # shards throughput: the counted window of each figure
    shard_rounds: int = 3  # shards throughput: rounds (the figure is their median)
    lock_seconds: float = 3.0  # locks: the counted window of each contended figure
    replica_keys: int = 2000  # replicas: entries written, read and rewritten
    replica_seconds: float = 6.0  # replicas: each setting's outage run (a node killed halfway)

    def problem(self) -> str | None:
        """Why these sizes cannot run, naming the option; None when they can."""
        if self.capacity_mb < MIN_CAPACITY_MB:
            return (f"--capacity-mb must be at least {MIN_CAPACITY_MB}: memcached gives every slab "
                    f"class a page, so a smaller node holds more than its -m")
        if self.capacity_fill <= 0:
            return "--capacity-fill must be above 0"
        if not self.scale_rows or min(self.scale_rows) < 1000 or self.scale_calls < 1:
            return "--scale-rows must be sizes of at least 1000 and --scale-calls at least 1"
        if not 0 < self.scale_buffer_pool <= 4:
            return "--scale-buffer-pool is a fraction of the tables' bytes, e.g. 0.2 (above 0)"
        if self.storage_entries < 1:
            return "--storage-entries must be at least 1"
        if self.server_cpu is not None and not 0 < self.server_cpu <= 64:
            return "--server-cpu is a fraction of a core, e.g. 0.12 (above 0)"
        if self.client_processes < 1 or self.client_threads < 1:
            return "--client-processes and --client-threads must be at least 1"
        if self.shard_seconds <= 0 or self.shard_rounds < 1:
            return "--shard-seconds must be above 0 and --shard-rounds at least 1"
        if self.lock_seconds <= 0:
            return "--lock-seconds must be above 0"
        if self.replica_keys < 1 or self.replica_seconds <= 0:
            return "--replica-keys must be at least 1 and --replica-seconds above 0"
        return None

    @classmethod
    def site_quick(cls) -> Parameters:
        """A site's caches (each with Django's beside it) in under a minute."""
        return cls(rounds=3, calls=10, batch=20, rows=(1_000,), row_calls=30, workers=(1, 4),
                   iterations=20, callers=(8,), storage_entries=200, codec_values=300)

    @classmethod
    def quick(cls) -> Parameters:
        """Small enough for the whole default set of caches in under two minutes."""
        return cls(rounds=3, calls=15, batch=20, rows=(1_000, 10_000), row_calls=40,
                   node_calls=60, workers=(1, 4), iterations=30, callers=(8, 32), storage_entries=200,
                   codec_values=300,
                   capacity_mb=16, capacity_fill=2.5, shard_seconds=1.0, shard_rounds=1,
                   lock_seconds=1.0, replica_keys=500, replica_seconds=2.0)


@dataclass
class Context:
    token: str
    parameters: Parameters
    caches: list[CacheSpec]
    reference: str | None
    memcached_nodes: list[str]
    show_progress: bool = True
    written: WrittenKeys = field(default_factory=WrittenKeys)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    instances: dict[str, BaseCache] = field(default_factory=dict)
    values: Values | None = None  # the mix's values, generated once per mix

    def cache(self, spec: CacheSpec) -> BaseCache:
        """One instance per cache for the main thread, built on first use."""
        if spec.name not in self.instances:
            self.instances[spec.name] = spec.build()
        return self.instances[spec.name]

    def progress(self, scenario: str, total: int) -> Any:
        """A progress bar on stderr, only when stderr is a terminal: in a log file (``make
        bench > log``, cron, CI) its redraws would be thousands of lines."""
        from tqdm import tqdm  # the bench extra; the command checks it is there first

        shown = self.show_progress and sys.stderr.isatty()
        return tqdm(total=total, desc=scenario, unit="step", file=sys.stderr,
                    disable=not shown, leave=False, dynamic_ncols=True, mininterval=0.5)
