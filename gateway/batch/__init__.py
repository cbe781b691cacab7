"""The Batch API: OpenAI-compatible files and batches, durable on the control node."""
