"""The simulated engine: vLLM's wire with modelled GPU timing (issue 8)."""
