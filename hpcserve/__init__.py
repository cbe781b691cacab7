"""hpcserve: Slurm-native serving of open-weight LLMs behind one OpenAI-compatible endpoint."""

__version__ = "0.1.0"
