"""Model implementations (GPT-2, Llama) over the paged KV cache, and their loader."""

from nanoserve.models.loader import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]
