"""Sample resilient agent: a named five-stage workflow that survives a crash mid-response.

For the newest stack only (agent-framework-foundry-hosting 1.0.0b261022, core 1.23.0,
azure-ai-agentserver-responses 2.4.0b1). Needs no model, credentials or network access.

    input ──▶ one ──▶ two ──▶ three ──▶ four ──▶ five ──▶ "stages: one,two,three,four,five"

* Each stage is an executor that waits ``STAGE_SECONDS`` (default 1 s), appends its name to
  the running list it received and sends the list on. The last stage yields one output:
  ``"stages: one,two,three,four,five"``. Every stage runs in its own superstep, and the host
  checkpoints the workflow after every superstep.
* Stages are **idempotent**: a stage's result depends only on the message it received, and
  it has no side effects. That matters because a superstep interrupted by a crash is run
  again from the last checkpoint after recovery.
* Hosted with ``ResponsesHostServer(workflow=<request-aware factory>, parse_response=...,
  options=ResponsesServerOptions(resilient_background=True))``. Since hosting 1.0.0b261015
  only a factory (a callable taking the request and returning a *fresh* built workflow) can
  be recovered; a built ``Workflow`` instance is rejected together with
  ``resilient_background=True``.
* The workflow is named (``WorkflowBuilder(name="resilient-workflow", ...)``) and its executor
  ids are fixed: recovery checks the checkpoint's workflow name and graph signature.

A background response (``{"input": "go", "background": true, "store": true}``) runs as a
resilient task. If the process dies, the next process started with the same
``AGENTSERVER_STATE_ROOT`` contents, ``FOUNDRY_AGENT_NAME`` and ``FOUNDRY_AGENT_SESSION_ID``
(the task's lease owner is ``"<agent name>|session:<session id>"``) reclaims the task at
startup and resumes the workflow from its last checkpoint.

Run:  PORT=8088 python app.py      (HOST defaults to 0.0.0.0)
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from agent_framework import Executor, Workflow, WorkflowBuilder, WorkflowContext, handler
from agent_framework_foundry_hosting import HostedResponseRequest, ResponsesHostServer, WorkflowTurn
from azure.ai.agentserver.responses import ResponsesServerOptions

WORKFLOW_NAME = "resilient-workflow"
STAGES = ("one", "two", "three", "four", "five")

logger = logging.getLogger("resilient_agent")


def stage_seconds() -> float:
    return float(os.environ.get("STAGE_SECONDS", "1"))


class Stage(Executor):
    """Waits a moment, appends its name to the running list and passes the list on.

    A pure function of its input: running it again after a crash gives the same result.
    """

    def __init__(self, name: str, last: bool = False) -> None:
        super().__init__(id=f"stage_{name}")
        self.stage = name
        self.last = last

    @handler
    async def run(self, done: list[str], ctx: WorkflowContext[list[str], str]) -> None:
        logger.info("stage %s started (after %s)", self.stage, ",".join(done) or "-")
        await asyncio.sleep(stage_seconds())
        stages = [*done, self.stage]
        logger.info("stage %s finished", self.stage)
        if self.last:
            await ctx.yield_output("stages: " + ",".join(stages))
        else:
            await ctx.send_message(stages)


class Start(Executor):
    """Start executor: takes the request's text and starts the chain with no stages done."""

    @handler
    async def start(self, text: str, ctx: WorkflowContext[list[str]]) -> None:
        logger.info("workflow started with input %r", text)
        await ctx.send_message([])


def build_workflow(request: HostedResponseRequest | None = None) -> Workflow:
    """Request-aware factory: a fresh graph (new executor instances, same ids) per call."""
    start = Start(id="start")
    stages = [Stage(name, last=(i == len(STAGES) - 1)) for i, name in enumerate(STAGES)]
    builder = WorkflowBuilder(name=WORKFLOW_NAME, start_executor=start, output_from=[stages[-1]])
    builder.add_edge(start, stages[0])
    for a, b in zip(stages, stages[1:]):
        builder.add_edge(a, b)
    return builder.build()


async def parse_response(request: HostedResponseRequest) -> WorkflowTurn[str]:
    """The turn's input text (any text starts the workflow)."""
    return WorkflowTurn(input=(await request.get_input_text()) or "")


def main() -> None:
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO"), stream=sys.stderr)
    kwargs = {}
    if os.environ.get("AGENT_OBSERVABILITY", "").strip().lower() in ("0", "false", "off", "no"):
        kwargs["configure_observability"] = None
    server = ResponsesHostServer(
        workflow=build_workflow,
        parse_response=parse_response,
        options=ResponsesServerOptions(resilient_background=True),
        **kwargs,
    )
    server.run(host=os.environ.get("HOST", "0.0.0.0"), port=int(os.environ.get("PORT", "8088")))


if __name__ == "__main__":
    main()
