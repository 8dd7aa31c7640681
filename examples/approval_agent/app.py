"""Sample approval agent: a named, two-step workflow that pauses for human approval.

The workflow is hosted with ``ResponsesHostServer`` (Responses protocol) and needs no
model, credentials or network access: both steps are plain executors.

1. ``receive_request`` takes the user's message (the first turn's ``input``) and passes its
   text on. A turn that carries no user text (for instance a bare ``function_call_output``
   that reached a fresh workflow because its checkpoint is gone) fails loudly.
2. ``approval_gate`` calls ``ctx.request_info(...)``. The host surfaces the request as a
   ``function_call`` output item named ``request_info``; the workflow is checkpointed and the
   turn completes. The client continues with ``previous_response_id`` and a
   ``function_call_output`` for that ``call_id``; the response handler then yields
   ``Completed with decision: <output>``.

The workflow is built with ``WorkflowBuilder(name="approval-workflow", ...)``. The name is
recorded in every checkpoint and the host only restores checkpoints whose name matches; an
unnamed builder gets a new ``WorkflowBuilder-<uuid>`` name in every process, so nothing it
wrote would be restored after a restart.

Run:  PORT=8088 python app.py      (HOST defaults to 0.0.0.0)
Set AGENT_OBSERVABILITY=0 to skip the hosting SDK's OpenTelemetry setup.

Works unmodified with agent-framework-foundry-hosting 1.0.0a260709 (core 1.11.0) and
1.0.0b261022 (core 1.23.0); the latter logs a deprecation warning for hosting a
``WorkflowAgent`` through the positional ``agent`` argument.
"""

import logging
import os
import sys
import warnings

from agent_framework import Executor, Message, WorkflowBuilder, WorkflowContext, handler, response_handler
from agent_framework_foundry_hosting import ResponsesHostServer
from typing_extensions import Never

WORKFLOW_NAME = "approval-workflow"

logger = logging.getLogger("approval_agent")


class ReceiveRequest(Executor):
    """Start executor: extracts the user's text from the turn's messages."""

    @handler
    async def on_messages(self, messages: list[Message], ctx: WorkflowContext[str]) -> None:
        text = " ".join(m.text for m in messages if m.role == "user" and m.text).strip()
        if not text:
            # Reached when a continuation (only a function_call_output, no user text) runs a
            # fresh workflow because the paused workflow's checkpoint could not be found.
            raise ValueError(
                "approval-workflow needs a user message to start; no paused workflow was restored "
                "for this turn (is the checkpoint missing?)"
            )
        logger.info("received request: %r", text)
        await ctx.send_message(text)


class ApprovalGate(Executor):
    """Asks a human for approval and reports the decision."""

    @handler
    async def on_request(self, text: str, ctx: WorkflowContext) -> None:
        # str request/response payloads keep the checkpoint JSON free of custom pickled types.
        await ctx.request_info(f"Approve the request {text!r}? Reply 'approved' or 'rejected'.", str)

    @response_handler
    async def on_decision(self, original_request: str, response: str, ctx: WorkflowContext[Never, str]) -> None:
        logger.info("decision received: %r", response)
        await ctx.yield_output(f"Completed with decision: {response}")


def build_agent():
    receive = ReceiveRequest(id="receive_request")
    gate = ApprovalGate(id="approval_gate")
    workflow = (
        WorkflowBuilder(name=WORKFLOW_NAME, start_executor=receive, output_from=[gate])
        .add_edge(receive, gate)
        .build()
    )
    return workflow.as_agent(name="approval-agent")


def main() -> None:
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO"), stream=sys.stderr)
    kwargs = {}
    if os.environ.get("AGENT_OBSERVABILITY", "").strip().lower() in ("0", "false", "off", "no"):
        # Skip the SDK's OpenTelemetry setup (console span exporter, SDK stats, cloud metadata
        # probes). Useful for tests: the host then starts and stops faster and stays offline.
        kwargs["configure_observability"] = None
    with warnings.catch_warnings():
        # Newer hosting releases deprecate hosting a WorkflowAgent via ``agent=``; it still works.
        warnings.simplefilter("ignore", DeprecationWarning)
        server = ResponsesHostServer(build_agent(), **kwargs)
    host = os.environ.get("HOST", "0.0.0.0")
    port = int(os.environ.get("PORT", "8088"))
    server.run(host=host, port=port)


if __name__ == "__main__":
    main()
