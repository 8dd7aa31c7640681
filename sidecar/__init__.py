"""checkpoint-sidecar: mirror agent workflow state to durable storage and bring it back."""

__version__ = "0.1.0"
