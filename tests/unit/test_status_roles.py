"""`hpcserve status`: each pool's role, and an elastic batch pool's range and backlog."""

from __future__ import annotations

from hpcserve.config import parse_config
from hpcserve.poolmgr.state_files import PoolStatus
from hpcserve.status import format_status, pool_row


def test_status_shows_roles_and_the_batch_pools_size_and_backlog() -> None:
    config = parse_config({
        "pools": [{"name": "chat", "model_path": "/m", "replicas": 2},
                  {"name": "bulk", "model_path": "/m", "served_model_name": "chat",
                   "role": "batch", "replicas": 1, "max_replicas": 4}],
    })  # fmt: skip
    chat, bulk = config.pools
    jobs = [{"pool": "chat"}, {"pool": "chat"}, {"pool": "bulk"}, {"pool": "bulk"}]
    replicas = [{"pool": "chat"}, {"pool": "bulk"}]
    report = PoolStatus(
        pool="bulk", model="chat", desired=3, live=2, serving=1, admin=0, draining=0,
        retiring=0, role="batch", max_replicas=4, backlog=340,
    )  # fmt: skip
    rows = [pool_row(chat, jobs, replicas, None), pool_row(bulk, jobs, replicas, report)]
    assert rows[0]["role"] == "interactive" and "elastic" not in rows[0]
    wanted = {"role": "batch", "desired": 3, "jobs": 2, "serving": 1, "backlog": 340,
              "elastic": "1..4, backlog 340"}  # fmt: skip
    assert {k: rows[1][k] for k in wanted} == wanted
    table = format_status({"pools": rows, "jobs": [], "replicas": [], "nodes": [], "errors": []})
    header, first, second = table.splitlines()
    assert header.split()[:8] == [
        "POOL", "MODEL", "ROLE", "DESIRED", "JOBS", "SERVING", "ADMIN", "ELASTIC",
    ]  # fmt: skip
    assert first.split()[:6] == ["chat", "chat", "interactive", "2", "2", "1"]
    assert second.split()[:8] == ["bulk", "chat", "batch", "3", "2", "1", "0", "1..4,"]
    assert "backlog 340" in second
