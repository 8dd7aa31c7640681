"""Run in an agent venv (core ≥ 1.26.0): several checkpoints of one context whose timestamps tie.

    python tied_checkpoints.py write DIR    three checkpoints of one chain (root <- middle <- leaf),
                                            all with one timestamp, saved by FileCheckpointStorage
    python tied_checkpoints.py latest DIR   the checkpoint_id get_latest picks there

Core 1.26.0 resolves a timestamp tie by lineage: among the newest, one named by another's
``previous_checkpoint_id`` is superseded, then the greatest ``checkpoint_id`` wins. The ids are
chosen so that the leaf has the smallest: without the middle checkpoint the root and the leaf both
look unsuperseded, and the root (greatest id) wins. The pick depends on the whole set.
"""

import asyncio
import sys

from agent_framework import FileCheckpointStorage, WorkflowCheckpoint

WORKFLOW = "approval-workflow"
TIMESTAMP = "2026-12-07T06:00:00+00:00"
#: (checkpoint_id, previous_checkpoint_id): root <- middle <- leaf.
CHAIN = (("c-root", None), ("b-middle", "c-root"), ("a-leaf", "b-middle"))


async def main(command: str, directory: str) -> None:
    storage = FileCheckpointStorage(directory)
    if command == "write":
        for checkpoint_id, previous in CHAIN:
            await storage.save(WorkflowCheckpoint(
                workflow_name=WORKFLOW, graph_signature_hash="tie", checkpoint_id=checkpoint_id,
                previous_checkpoint_id=previous, timestamp=TIMESTAMP))
    latest = await storage.get_latest(workflow_name=WORKFLOW)
    print(latest.checkpoint_id if latest else "none")


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:3]))
