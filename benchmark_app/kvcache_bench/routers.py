"""Route each benchmarked DatabaseCache table to its database alias."""
from __future__ import annotations

from typing import Any

#: Tables whose name starts with this live in the "sqlite" database.
SQLITE_TABLE_PREFIX = "kvbench_sqlite_"


class CacheTableRouter:
    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        table = getattr(model._meta, "db_table", "")
        return "sqlite" if table.startswith(SQLITE_TABLE_PREFIX) else None

    db_for_write = db_for_read
